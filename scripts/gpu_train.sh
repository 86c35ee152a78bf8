#!/usr/bin/env bash
# Train m3-mini on one GPU, export done by a deadline (DEADLINE seconds, 570 by default), and leave the checkpoint
# in 15 MB pieces, small enough for any file transfer.
#
#   OUT=DIR [DEADLINE=570] [COMPILE=1] [PROFILE=0] [TRAIN_ARGS="..."] [TOKENIZER=...] bash scripts/gpu_train.sh
#
# Needs the prepared arrays in data/prepared (python -m training.prepare; chats.npz, long.npz and text.npz are all
# it reads, about 30 MB: carry data/prepared with the repository) and a CUDA PyTorch; nothing is installed and
# nothing is fetched. By default it starts from the shipped weights (--init nanoserve/presets/m3_mini) and trains
# retrieval windows of 16,384 tokens, the model's whole context. In order:
#   1. (PROFILE=1) `training.train --profile-steps 10` with packed fixed-shape steps, eager and with --compile;
#      the faster of the two (tokens per second) is the one trained. Both tables go to $OUT/profile.txt. Without
#      it the steps are compiled (COMPILE=1, the default: 316 k against 154 k tokens/s eager on an H100), so the
#      whole call trains.
#   2. `training.train` with $TRAIN_ARGS, its time budget set so that the export is done DEADLINE seconds after
#      the script started; the log in $OUT/train.txt and $OUT/train_log.jsonl.
#   3. The exported checkpoint directory as $OUT/checkpoint.tar.part-aa, -ab, ... (15 MB each); put it back with
#      `cat checkpoint.tar.part-* | tar x -C data/run`. Each save during the run (every 120 s) is packed there too,
#      so a call cut short returns the latest one.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:?set OUT to a directory for the logs and the checkpoint}
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
TRAIN_ARGS=${TRAIN_ARGS:---batch 16 --seq 1280 --long-seq 16384 --long-tokens 16384 --long-every 4 --text-frac 0.2 --long-text-frac 0.35 --warmup 300 --pack --init nanoserve/presets/m3_mini}
RUN=${RUN:-/tmp/m3_mini_run}
DEVICE=${DEVICE:-cuda}  # cpu: a check of the script (with small TRAIN_ARGS and COMPILE=0)
# the frozen tokenizer the package ships (the same file training.tokenizer wrote), so data/tokenizer need not travel
TOKENIZER=${TOKENIZER:-nanoserve/presets/m3_mini/tokenizer.json}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null; } | tee "$OUT/gpu.txt"

# the arrays are zips compressed with LZMA (training/prepare.py): a Python without its lzma module cannot read them
python3 -c "import lzma" || { echo "python3 has no lzma module: data/prepared cannot be read"; exit 1; }
[ -f data/prepared/chats.npz ] || { echo "no data/prepared/chats.npz: run python -m training.prepare and carry it"; exit 1; }

rate() {  # tokens per second from a --profile-steps report, 0 when it failed
  grep -o 'profile: [0-9]* steps, [0-9]* tokens, [0-9.]* s' "$1" | awk '{print $4 / $6}' | tail -1 | grep . || echo 0
}
compile=""
[ "${COMPILE:-1}" = 1 ] && compile="--compile"
if [ "${PROFILE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout 120 python3 -m training.train --device "$DEVICE" --profile-steps 10 $TRAIN_ARGS --out /tmp/profile_eager \
    > /tmp/profile_eager.txt 2>&1
  # shellcheck disable=SC2086
  timeout 240 python3 -m training.train --device "$DEVICE" --profile-steps 10 $TRAIN_ARGS --compile \
    --out /tmp/profile_compile > /tmp/profile_compile.txt 2>&1
  eager=$(rate /tmp/profile_eager.txt) compiled=$(rate /tmp/profile_compile.txt)
  { echo "== eager: $eager tokens/s"; cat /tmp/profile_eager.txt
    echo "== compiled: $compiled tokens/s"; cat /tmp/profile_compile.txt; } > "$OUT/profile.txt"
  echo "profile: eager $eager tokens/s, compiled $compiled tokens/s"
  compile=""
  if awk -v a="$eager" -v b="$compiled" 'BEGIN {exit !(b > 1.1 * a)}'; then compile="--compile"; fi
fi
# a call cut short (the machine taken back, the call's limit) still returns the latest save: every --save-every
# export is packed into $OUT as the final one is, once it has not changed for 10 s (export.py writes it whole)
pack() {
  cp "$RUN/train_log.jsonl" "$OUT/" 2>/dev/null
  tar cf /tmp/checkpoint.tar -C "$RUN" checkpoint && rm -f "$OUT"/checkpoint.tar.part-* \
    && split -b 15M /tmp/checkpoint.tar "$OUT/checkpoint.tar.part-"
}
( packed=0
  while sleep 15; do
    f="$RUN/checkpoint/model.safetensors"
    [ -f "$f" ] || continue
    m=$(stat -c %Y "$f")
    if [ "$m" != "$packed" ] && [ $(( $(date +%s) - m )) -ge 10 ]; then pack; packed=$m; fi
  done ) &
watcher=$!
budget=$(( ${DEADLINE:-570} - ($(date +%s) - start) - 30 ))
echo "training for $budget s ${compile:+with --compile}"
# shellcheck disable=SC2086
timeout $(( budget + 25 )) python3 -m training.train --device "$DEVICE" $TRAIN_ARGS $compile --tokenizer "$TOKENIZER" --time-budget "$budget" \
  --save-every 120 --out "$RUN" > "$OUT/train.txt" 2>&1
echo "train exit $?"
kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null
tail -3 "$OUT/train.txt"
pack
ls -la "$OUT"
