#!/bin/bash
B=$PWD/.gpu/bin; O=$OUT
mkdir -p /tmp/base /tmp/u8; cp $B/sfx /tmp/base/sfx; cp $B/sfx_u8 /tmp/u8/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/base PEER=$PWD/.peers/llamacpp OUT=$O bash scripts/gpu/side_by_side.sh prepare
tg() { $1/sfx bench $M --quant qtip2 -p 0 -n 128 -r 2 2>&1 | grep -E 'tg128' | grep -v graphs | awk -F'|' '{print $9}' | awk '{print $1}'; }
ok=1
for op in trellis_linear trellis_projections trellis_swiglu model_decode; do
  /tmp/u8/sfx test-backend --device cuda --op $op > $O/u8_tb_$op.md 2>&1
  echo "u8 $op: $(grep 'cases on cuda' $O/u8_tb_$op.md)"; grep -q "0 failed" $O/u8_tb_$op.md || ok=0
done
b1=$(tg /tmp/base); u1=$(tg /tmp/u8); b2=$(tg /tmp/base); u2=$(tg /tmp/u8)
echo "A/B qtip2 hyb tg128: base $b1 $b2  unroll8 $u1 $u2" | tee $O/ab.md
SEL=/tmp/base
if [ $ok = 1 ] && python3 -c "import sys; sys.exit(0 if ($u1+$u2) > 1.003*($b1+$b2) else 1)"; then SEL=/tmp/u8; fi
echo "selected $SEL" | tee -a $O/ab.md
echo "ab $(( $(date +%s) - t0 )) s"
OPS="trellis_linear trellis_projections trellis_swiglu model_decode group_linear group_projections group_swiglu" \
  BIN=$SEL PEER=$PWD/.peers/llamacpp OUT=$O bash scripts/gpu/side_by_side.sh trellis_peer
echo "total $(( $(date +%s) - t0 )) s"
