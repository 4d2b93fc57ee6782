// Sizes of the sm90 dispatch kernels that the host side needs too (workspace layout, launch
// choice): plain C++, includable from host translation units.
#pragma once

#include <cstdint>

namespace megamoe::kernels::sm90 {

inline constexpr int kDispatchThreads = 1024;
inline constexpr int kDispatchMaxExperts = 2 * kDispatchThreads;  // two scan items per thread
// Selections each thread keeps in registers between the two passes (T * k up to 4096, e.g.
// DeepSeek-V3 up to T = 512): the second pass then issues no global load.
inline constexpr int kDispatchCachedPerThread = 4;
// Up to this many selections (T * k) the single-CTA kernel runs (every id cached in registers);
// above, the multi-CTA pair, at least kDispatchThreads selections per CTA.
inline constexpr int64_t kDispatchSingleCtaItems = int64_t{kDispatchCachedPerThread} * kDispatchThreads;
// Dynamic shared memory of the single-CTA kernel: the routed slots' tokens and weights, staged
// (at most kDispatchSingleCtaItems slots), with the per-expert counts aliased at its start (they
// are dead once the offsets are scanned, before the first slot is staged).
inline constexpr int kDispatchStageBytes = static_cast<int>(kDispatchSingleCtaItems) * (4 + 4);
static_assert(kDispatchMaxExperts * 4 <= kDispatchStageBytes, "the counts must fit the staging area");
inline constexpr int kDispatchMaxCtas = 128;

}  // namespace megamoe::kernels::sm90
