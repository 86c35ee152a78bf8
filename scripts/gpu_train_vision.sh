#!/usr/bin/env bash
# Teach a trained m3-mini to read pictures on one GPU (training/train_vision.py), done by a deadline, and leave the
# checkpoint (text and vision tensors, one model) in 15 MB pieces.
#
#   OUT=DIR [INIT=data/run/checkpoint] [BUDGET=300] [VISION_ARGS="..."] bash scripts/gpu_train_vision.sh
#
# INIT is the text model to start from (a checkpoint directory export.py wrote, e.g. gpu_train.sh's, unpacked with
# `cat checkpoint.tar.part-* | tar x -C data/run`; or, in a call right after gpu_train.sh's on the same machine,
# its /tmp/m3_mini_run/checkpoint, nothing carried). Given and missing, the script stops; not given, data/run's,
# else the shipped nanoserve/presets/m3_mini. The text chats it rehearses beside the pictures come from data/prepared/chats.npz (carry it). The run's log
# goes to $OUT/vision.txt and $OUT/vision_log.jsonl, the checkpoint to $OUT/vision_checkpoint.tar.part-aa, -ab, ...
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:?set OUT to a directory for the logs and the checkpoint}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -n "${INIT:-}" ]; then  # a text model asked for must be there: no silent fallback to the shipped one
  [ -f "$INIT/model.safetensors" ] || { echo "INIT=$INIT has no model.safetensors"; exit 1; }
else
  INIT=data/run/checkpoint
  [ -f "$INIT/model.safetensors" ] || INIT=nanoserve/presets/m3_mini
fi
[ -f data/prepared/chats.npz ] || { echo "no data/prepared/chats.npz: carry it"; exit 1; }
BUDGET=${BUDGET:-300}
RUN=${RUN:-/tmp/m3_mini_vision}
DEVICE=${DEVICE:-cuda}  # cpu: a check of the script (with a small BUDGET and VISION_ARGS)
echo "vision training from $INIT for $BUDGET s"
# shellcheck disable=SC2086
timeout $(( BUDGET + 120 )) python3 -m training.train_vision --device "$DEVICE" --init "$INIT" --out "$RUN" \
  --time-budget "$BUDGET" --text-data data/prepared ${VISION_ARGS:-} > "$OUT/vision.txt" 2>&1
echo "vision training exit $?"
tail -3 "$OUT/vision.txt"
cp "$RUN/train_log.jsonl" "$OUT/vision_log.jsonl" 2>/dev/null
tar cf /tmp/vision_checkpoint.tar -C "$RUN" checkpoint && split -b 15M /tmp/vision_checkpoint.tar "$OUT/vision_checkpoint.tar.part-"
