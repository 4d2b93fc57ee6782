/* Links the installed libmegamoe through its C API: the header's version is the library's, and a
 * call fails the documented way. */
#include <stdio.h>
#include <string.h>

#include "megamoe/megamoe.h"

int cxx_api_works(void); /* consumer_cxx.cpp */

int main(void) {
  megamoe_checkpoint* checkpoint = NULL;
  megamoe_status status;
  if (megamoe_version() != MEGAMOE_VERSION) {
    fprintf(stderr, "header version %d, library version %u\n", MEGAMOE_VERSION, (unsigned)megamoe_version());
    return 1;
  }
  status = megamoe_checkpoint_open("/nonexistent", &checkpoint);
  if (status != MEGAMOE_ERROR_NOT_FOUND || strstr(megamoe_last_error(), "/nonexistent") == NULL) {
    fprintf(stderr, "megamoe_checkpoint_open: %s: %s\n", megamoe_status_name(status), megamoe_last_error());
    return 1;
  }
  if (!cxx_api_works()) return 1;
  printf("megamoe %s: C and C++ APIs linked from the installed package (CUDA: %s)\n",
         megamoe_version_string(), megamoe_has_cuda() ? "yes" : "no");
  return 0;
}
