#!/bin/bash
# Two trees side by side on one GPU machine, in one call: the real-model GRPO benchmark and the
# 4096-token long-tail run with partial rollouts, for an earlier commit and this working tree.
#
# Here (the real model's GGUF is 94 MB, over what one device call carries: two halves, two calls
# of one warm machine):
#   git archive --format=tar.gz -o .gpu/b/prev.tgz <commit> services benchmarks configs
#   G=$(.venv/bin/python -c 'from rolefleet.gguf_import import packaged_gguf; print(packaged_gguf())')
#   head -c 49181216 $G > .gpu/a/gguf.part1; tail -c +49181217 $G > .gpu/b/gguf.part2
# There: call 1 (carry .gpu/a): cp .gpu/a/gguf.part1 /tmp/   (and whatever else fits the call);
#        call 2 (carry .whl and .gpu/b, at once): bash benchmarks/ab_trees.sh .gpu/b
# Prints each run's step time; OUT gets rm_<tree>.json, lt_<tree>.json and the logs.
set -u
B=${1:?the folder with prev.tgz and gguf.part2}; R=$PWD; W=/tmp/ab; mkdir -p $W /tmp/prev /tmp/prevpkg /tmp/pkg
cat /tmp/gguf.part1 $B/gguf.part2 > /tmp/smol.gguf || { echo "no /tmp/gguf.part1: the first call did not run here"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 4
tar xzf $B/prev.tgz -C /tmp/prev && ln -sfn /tmp/prev/services /tmp/prevpkg/rolefleet
ln -sfn $R/services /tmp/pkg/rolefleet
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/pkg:/tmp/site python3 -m rolefleet.cli import-gguf /tmp/smol.gguf /tmp/smol > $W/import.log 2>&1 \
  || { tail -20 $W/import.log; exit 5; }
L="--max-new-tokens 4096 --set eval.every=0 actor.max_tokens_per_request=4194304"
for v in prev new; do
  if [ $v = prev ]; then cd /tmp/prev; P=/tmp/prevpkg:/tmp/site; else cd $R; P=/tmp/pkg:/tmp/site; fi
  PYTHONPATH=$P timeout 200 python3 benchmarks/real_model.py --model /tmp/smol --out $W/rm_$v --parts rolefleet \
    --steps 24 --eval-every 12 --eval-prompts 64 --set checkpoint.at_end=false > $W/rm_$v.log 2>&1
  echo "real_model $v: exit $?"; grep -o '"step_s": [0-9.]*' $W/rm_$v.log | head -1
  PYTHONPATH=$P timeout 150 python3 benchmarks/long_tail.py --model /tmp/smol --out $W/lt_$v --parts partial \
    --steps 6 --warmup 2 --budget 512 $L > $W/lt_$v.log 2>&1
  echo "long_tail $v: exit $?"; tail -2 $W/lt_$v.log
done
cd $R
for v in prev new; do
  cp $W/rm_$v/real_model.json $OUT/rm_$v.json 2>/dev/null; cp $W/lt_$v/long_tail.json $OUT/lt_$v.json 2>/dev/null
done
tar czf $OUT/logs.tgz -C $W $(cd $W && ls *.log)
