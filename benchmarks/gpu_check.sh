#!/usr/bin/env bash
# GPU sanity check for a session that is lent a CUDA machine (written for one H200). It records:
#   $OUT/env.log            nvidia-smi, torch / CUDA versions, whether grimoire and its deps import
#   $OUT/fsdp2_step.log     two FSDP2 training steps in bf16 on CUDA (SFT, fused log-probs asked
#                           for): one plain process, `torchrun --nproc-per-node 1`, and one
#                           process with fsdp_cpu_offload (it cannot run on a CPU-only machine)
#   $OUT/fused_logprobs.log benchmarks/fused_logprobs.py --device cuda (fused vs full logits)
#   $OUT/test_fsdp2.log     python -m pytest -q tests/test_fsdp2.py (CPU / gloo, as in CI)
#   $OUT/summary.txt        one line per section: its exit code and seconds
# Nothing in CI runs or depends on this script; it has not been run yet. It installs nothing
# but grimoire itself (`pip install -e .`, only if grimoire is not importable; torch with CUDA
# must already be there). A failing section is recorded and the next one runs.
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh      # about 6-8 minutes on one H200
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
: >"$OUT/summary.txt"

# section NAME LOG TIMEOUT_S CMD...: run CMD under a time limit, append its output to LOG, record rc
section() {
  local name=$1 log=$2 limit=$3 rc start=$SECONDS
  shift 3
  echo "=== $name: $*" | tee -a "$OUT/$log"
  if timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"; then rc=0; else rc=$?; fi
  echo "$name rc=$rc ($((SECONDS - start)) s)" | tee -a "$OUT/summary.txt" "$OUT/$log"
}

# ---------------------------------------------------------------- environment
section nvidia-smi env.log 30 nvidia-smi
section torch env.log 60 python -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print('bf16', torch.cuda.is_available() and torch.cuda.is_bf16_supported())
print('nccl', torch.distributed.is_nccl_available())
import transformers, accelerate, peft, datasets
print('transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)
"
if ! python -c "import grimoire" >/dev/null 2>&1; then
  section pip-install env.log 300 pip install -e .
fi
section grimoire env.log 60 python -c "import grimoire, sys; print('grimoire from', grimoire.__file__)"

# ---------------------------------------------------------------- FSDP2, bf16, CUDA
cat >"$WORK/fsdp2_step.py" <<'PY'
"""Two FSDP2 steps (bf16 MixedPrecisionPolicy) of SFT on CUDA; prints what ran where.
OFFLOAD=1: fsdp_cpu_offload (shards and optimizer state in CPU memory)."""
import logging, math, os, random, tempfile
import torch
from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
from grimoire.losses import SFTLoss
from grimoire.tiny import build_model, build_tokenizer

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
model = build_model("llama", vocab_size=32000, hidden_size=1024, num_layers=8,
                    tie_word_embeddings=False, max_position_embeddings=2048)
rng = random.Random(0)
rows = [{"input_ids": ids, "labels": [-100] * 8 + ids[8:]}
        for ids in ([rng.randrange(8, 32000) for _ in range(512)] for _ in range(8))]
losses = []


class Losses(TrainerCallback):
    def on_step_end(self, trainer, step, loss, metrics):
        losses.append(loss)


with tempfile.TemporaryDirectory() as out:
    config = TrainingConfig(output_dir=out, max_steps=2, batch_size=4, distributed="fsdp2",
                            mixed_precision="bf16", logging_steps=1, progress_bar=False,
                            save_on_epoch_end=False, learning_rate=1e-4,
                            fsdp_cpu_offload=os.environ.get("OFFLOAD") == "1")
    trainer = GrimoireTrainer(model, build_tokenizer(), config, SFTLoss(fused=True), rows,
                              callbacks=[Losses()])
    trainer.train()
    p = next(trainer.model.parameters())
    local = p.to_local() if hasattr(p, "to_local") else p
    print(f"rank {trainer.accelerator.process_index}/{trainer.accelerator.num_processes}: "
          f"param {type(p).__name__} local {tuple(local.shape)} {local.dtype} on {local.device}; "
          f"backend {torch.distributed.get_backend() if torch.distributed.is_initialized() else None}; "
          f"losses {losses}; max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    want = "cpu" if config.fsdp_cpu_offload else "cuda"
    ok = local.device.type == want and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    trainer.close()
raise SystemExit(0 if ok else 1)
PY
section fsdp2-1proc fsdp2_step.log 120 python "$WORK/fsdp2_step.py"
section fsdp2-torchrun fsdp2_step.log 120 \
  torchrun --nproc-per-node 1 --master-port 29533 "$WORK/fsdp2_step.py"
section fsdp2-cpu-offload fsdp2_step.log 120 env OFFLOAD=1 python "$WORK/fsdp2_step.py"

# ---------------------------------------------------------------- fused log-probs on CUDA
section fused-logprobs fused_logprobs.log 150 python benchmarks/fused_logprobs.py --device cuda \
  --vocabs 32000,128000,256000 --batch 4 --seq-len 2048 --hidden 2048 --layers 2 --repeats 5

# ---------------------------------------------------------------- FSDP2 tests (CPU, gloo)
# The tests are written for gloo on CPU; hide the GPU so both workers do not pick it with NCCL.
section test-fsdp2 test_fsdp2.log 240 env CUDA_VISIBLE_DEVICES= python -m pytest -q tests/test_fsdp2.py

cat "$OUT/summary.txt"
