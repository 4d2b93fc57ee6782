/* Compiled (not linked) by the test capi.header_is_c99: megamoe.h alone must be valid C99 under
 * -std=c99 -Wall -Wextra -Werror -pedantic, and valid C++ (capi.header_is_cxx). */
#include "megamoe/megamoe.h"

int main(void) {
  megamoe_layer_options options;
  megamoe_stream stream = 0;
  (void)stream;
  return megamoe_layer_options_init(&options) == MEGAMOE_OK && megamoe_version() == MEGAMOE_VERSION ? 0 : 1;
}
