#!/usr/bin/env bash
# SASS check of the sm90 W4A16 GEMM kernels in a built binary (no GPU needed): every
# grouped-GEMM and fused-MoE kernel must issue HGMMA, i.e. the decoded weights reach the tensor
# cores through wgmma (issue 3: "the disassembly of the L1 and L2 mainloops must show HGMMA").
#
# It also prints, per kernel, the instructions per pipeline group (between CTA barriers, or
# mbarrier waits in the absorbing tile's loop: SYNCS.PHASECHK) and
# the uniform-register copies (UMOV URa, URb) between consecutive HGMMAs of one group. Those
# copies are ptxas moving a wgmma descriptor into the register pair the HGMMA reads; how many
# there are depends on what else is live around an inlined mainloop (a change to the fused
# kernel's prologue once added 16 per K group of its L2 mainloop, 14% slower at DeepSeek-V3
# T=2 on H200, with no warning). Compare the counts before and after changing a kernel.
# Usage: check_sass.sh BINARY [CUOBJDUMP]
set -euo pipefail
bin=${1:?usage: check_sass.sh BINARY [CUOBJDUMP]}
cuobjdump=${2:-cuobjdump}
sass=$(mktemp)
trap 'rm -f "$sass"' EXIT
"$cuobjdump" -sass "$bin" > "$sass"
awk '
  function flush() {
    if (fn == "") return
    printf "  %-48s HGMMA %4d, descriptor copies %4d, instructions per group: %s\n", short, hgmma, copies, groups
    if (hgmma == 0) { print "check_sass: FAIL: no HGMMA in " fn; failed = 1 }
  }
  /Function : / {
    flush()
    fn = ""
    if ($3 !~ /w4a16_grouped_gemm_kernel|w4a16_fused_moe_kernel/) next
    fn = $3; kernels++
    short = fn
    sub(/^_ZN7megamoe7kernels4sm90[0-9]+/, "", short)
    sub(/EEEvNS1_.*/, "", short)
    hgmma = 0; copies = 0; since_hgmma = -1; groups = ""; group_len = 0; ngroups = 0
    next
  }
  fn == "" { next }
  !/^ +\/\*[0-9a-f]+\*\// { next }
  {
    group_len++
    if ($0 ~ /BAR\.SYNC|SYNCS\.PHASECHK/) {
      if (ngroups++ < 12) groups = groups group_len " "
      group_len = 0; since_hgmma = -1
    } else if ($0 ~ /HGMMA/) {
      hgmma++
      if (since_hgmma > 0) copies += since_hgmma
      since_hgmma = 0
    } else if (since_hgmma >= 0 && $0 ~ /UMOV UR[0-9]+, UR[0-9]+ *;/) {
      since_hgmma++
    }
  }
  END {
    flush()
    if (kernels == 0) { print "check_sass: no W4A16 GEMM kernels found in the binary"; exit 1 }
    if (failed) exit 1
    printf "check_sass: all %d W4A16 GEMM kernels issue HGMMA\n", kernels
  }
' "$sass"
