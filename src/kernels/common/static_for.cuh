// Compile-time loops for device code: unrolled with every index a constant expression (stage
// indices, register arrays), where a #pragma unroll loop would still leave ptxas an index.
#pragma once

#include <utility>

namespace megamoe::kernels {

// Calls f(std::integral_constant<int, i>) for i = 0 .. N-1 (compile-time indices).
template <int N, class F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl<N>(f, std::make_integer_sequence<int, N>{});
}

}  // namespace megamoe::kernels
