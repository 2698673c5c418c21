#!/bin/bash
# Issue 14 sixth slice, call F: where the read-ahead build's 1.1 % of qtip2 base goes: per-kernel
# decode times (SFX_PROFILE_KERNELS=1, step graphs off) of final (ade23a1) and head (0bcee83),
# alternating, two rounds each.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/f $O/f
for n in final head; do xz -dc .gpu/$n.xz > /tmp/f/$n; chmod +x /tmp/f/$n; done
for round in 1 2; do for n in final head; do
  SFX_PROFILE_KERNELS=1 timeout 90 /tmp/f/$n bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 32 -r 1 --graphs off \
    > $O/f/prof_${n}_r$round.md 2> $O/f/prof_${n}_r$round.err
  echo "round $round $n: $(grep -E 'tg32' $O/f/prof_${n}_r$round.md | awk -F'|' '{print $10}')"
done; done
for n in final head; do echo "== $n"; grep -E '^\| ' $O/f/prof_${n}_r2.err | head -16; done
tar czf $O/f.tgz -C $O f && rm -rf $O/f
echo "total $(( $(date +%s) - t0 )) s"
