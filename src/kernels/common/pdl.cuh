// Programmatic dependent launch (sm90): the kernels of one MoE run are launched back to back with
// cudaLaunchAttributeProgrammaticStreamSerialization, so a kernel's CTAs are scheduled while its
// predecessor is still running and only block, at grid_dependency_wait(), until the predecessor
// has completed and its memory is visible. This hides the launch gap between the kernels.
#pragma once

namespace megamoe::kernels {

// Let the next kernel in the stream start launching (its CTAs wait for this grid to finish).
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Wait until the previous kernel in the stream has completed and its writes are visible. A no-op
// when this kernel was launched without the programmatic-serialization attribute.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

}  // namespace megamoe::kernels
