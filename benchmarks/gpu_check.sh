#!/usr/bin/env bash
# GPU check for a session that is lent a CUDA machine (written for one H200). It records, most
# important first (issue #25, "the GPU step", then the earlier checks):
#   $OUT/env.log            nvidia-smi, torch / CUDA versions, whether grimoire and its deps import,
#                           which varlen kernels this torch has
#   $OUT/checks.log         benchmarks/gpu_checks.py: varlen-parity (packed rows through
#                           varlen_attn against per-sample sdpa, bf16), step-syncs (host reads per
#                           SFT / DPO step, also through torch's CUDA sync detector), sdpa-shapes,
#                           head-parity, use_liger=True, mixed_precision auto
#   $OUT/throughput.log     benchmarks/throughput.py --device cuda: SFT tok/s and MFU, ours packed
#                           (varlen) / ours padded (width buckets of 64) / grimoire-rl (where its
#                           wheel is carried), bf16, a 1024 x 8 model; TRL in its own section
#   $OUT/profile.log        benchmarks/profile_sft.py --device cuda: where the step's time goes,
#                           padded and packed, with and without cuDNN attention
#   $OUT/mfu_1b.log         throughput.py --model 1b: ours packed on a 1.04B Llama at ~16k tokens
#                           per step (MFU of a measured bf16 GEMM peak)
#   $OUT/cpu_bf16.log       the host CPU's AMX / AVX512-BF16 flags and throughput.py on that CPU
#                           (CUDA hidden), fp32 against bf16
#   $OUT/fsdp2_step.log     two FSDP2 training steps in bf16 on CUDA (SFT, fused log-probs asked
#                           for): one plain process, `torchrun --nproc-per-node 1`, and one
#                           process with fsdp_cpu_offload (it cannot run on a CPU-only machine)
#   $OUT/rollout.log        benchmarks/rollout_throughput.py --engines --device cuda: HF generate
#                           plain / static KV cache / one prefill per prompt (issue #26)
#   $OUT/fused_logprobs.log benchmarks/fused_logprobs.py --device cuda (fused vs full logits)
#   $OUT/summary.txt        one line per section: its exit code and seconds
# Nothing in CI runs or depends on this script. It runs grimoire from src/ (PYTHONPATH) and
# installs only what a `.whl/` folder next to it carries (liger-kernel, datasets, trl; grimoire-rl
# into its own folder, since both packages are named grimoire); torch with CUDA, transformers,
# accelerate and peft must already be there. A failing section is recorded and the next runs.
#
# Sections run most important first, each under its own time limit, and the whole script stays
# inside BUDGET_S seconds (default 540, under a device call's 600): a section that would start
# past it is skipped and recorded as such, so one call of a leased machine always returns its
# files. The issue #25 sections (through throughput-trl) take about 8 minutes on one H200
# (estimated from their limits: nothing of this version has run on a GPU yet); the rest runs in
# what is left of the budget, or is recorded as skipped.
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh      # about 9 minutes on one H200
#   DRY_RUN=1 bash benchmarks/gpu_check.sh               # on any machine: list the sections and
#                                                        # check every Python file they run compiles
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
BUDGET_S="${BUDGET_S:-540}"
DRY_RUN="${DRY_RUN:-0}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
: >"$OUT/summary.txt"
if ! command -v python >/dev/null; then  # images with only python3
  mkdir -p "$WORK/bin" && ln -s "$(command -v python3)" "$WORK/bin/python" && PATH="$WORK/bin:$PATH"
fi

# section NAME LOG TIMEOUT_S CMD...: run CMD under a time limit (cut to what is left of
# BUDGET_S), append its output to LOG, record rc; skipped when under 20 s are left.
section() {
  local name=$1 log=$2 limit=$3 rc start=$SECONDS left=$((BUDGET_S - SECONDS))
  shift 3
  if ((left < 20)); then
    echo "$name skipped (budget spent)" | tee -a "$OUT/summary.txt"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name: $*" | tee -a "$OUT/$log"
  if [[ $DRY_RUN == 1 ]]; then  # compile the Python files the command runs; run nothing
    local arg ok=1
    for arg in "$@"; do
      if [[ $arg == *.py && -f $arg ]]; then python -m py_compile "$arg" || ok=0; fi
    done
    echo "$name dry-run (limit ${limit} s; python files compile: $ok)" | tee -a "$OUT/summary.txt"
    return
  fi
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
import transformers, accelerate, peft
print('transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)
try:
    from torch.nn.attention.varlen import varlen_attn
    print('torch varlen_attn: yes')
except ImportError:
    print('torch varlen_attn: no')
"
if ls .whl/*.whl >/dev/null 2>&1; then
  mkdir -p /tmp/site /tmp/peer
  # One wheel at a time, so a wheel this python cannot take does not stop the others.
  section wheels env.log 120 sh -c 'for w in .whl/*.whl; do
    case $w in *grimoire_rl*) dest=/tmp/peer ;; *) dest=/tmp/site ;; esac
    python -m pip install -q --no-index --no-deps --no-compile --target $dest $w || echo "not installed: $w"
  done'
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
section grimoire env.log 60 python -c "import grimoire, sys; print('grimoire from', grimoire.__file__)"

section routes env.log 60 python -c "
import logging; logging.basicConfig(level=logging.INFO)
from grimoire.model import varlen_attention as va
import torch
print('kernels', va.describe())
print('packed rows, bf16, head_dim 128:', va.cuda_route(torch.bfloat16, 128, 0.0))
"

# ---------------------------------------------------------------- issue #25: the GPU step
section varlen-parity checks.log 90 python benchmarks/gpu_checks.py varlen-parity

# The peer runs under the same python with only its own folder in front (run_impl drops our
# PYTHONPATH for it): a two-line wrapper stands in for a venv's interpreter.
printf '#!/bin/sh\nPYTHONPATH=/tmp/peer:/tmp/site exec python "$@"\n' >"$WORK/peer-python"
chmod +x "$WORK/peer-python"
GPU_SFT=(--device cuda --precisions bf16 --batch 32 --max-len 2048 --max-tokens 16384 --steps 16 --warmup 4)
section throughput throughput.log 180 python benchmarks/throughput.py "${GPU_SFT[@]}" \
  --impls "ours packed" "ours padded" grimoire-rl --peer-python "$WORK/peer-python" \
  --json "$OUT/throughput.json"
section step-syncs checks.log 90 python benchmarks/gpu_checks.py step-syncs
PROFILE=(--device cuda --precision bf16 --batch 32 --max-len 2048 --max-tokens 16384 --steps 6 --warmup 2 --top 12)
section profile profile.log 60 python benchmarks/profile_sft.py "${PROFILE[@]}"
section profile-cudnn profile.log 60 python benchmarks/profile_sft.py "${PROFILE[@]}" --cudnn
# ~88 long-tailed rows (mean ~184 tokens) per step: ~16k tokens per step, one packed micro-batch.
section mfu-1b mfu_1b.log 120 python benchmarks/throughput.py --device cuda --model 1b \
  --precisions bf16 --impls "ours packed" --batch 88 --max-len 2048 --max-tokens 16384 \
  --steps 8 --warmup 3 --json "$OUT/mfu_1b.json"
section throughput-trl throughput.log 90 python benchmarks/throughput.py "${GPU_SFT[@]}" --impls trl

# ---------------------------------------------------------------- issue #26: HF rollout on CUDA
# Plain generate vs static cache vs one prefill per prompt (fp32; vLLM's CUDA build is not
# carried, so no vllm row): 64 prompts x 8 x 128 tokens.
section rollout rollout.log 120 python benchmarks/rollout_throughput.py --engines --device cuda

# ---------------------------------------------------------------- bf16 on the host's CPU
# Issue #16's AMX goal (bf16 >= 2x fp32 on a CPU with AMX) cannot be measured on the CPU-only
# development machine (AVX512-BF16, no AMX); GPU hosts are often Xeons with AMX.
section cpu-flags cpu_bf16.log 10 sh -c 'grep -o -w -E "amx_bf16|amx_tile|avx512_bf16" /proc/cpuinfo | sort | uniq -c'
section cpu-bf16 cpu_bf16.log 150 env CUDA_VISIBLE_DEVICES= python benchmarks/throughput.py \
  --precisions no bf16 --impls "ours packed" "ours padded" --threads 8 --steps 8 --warmup 2

# ---------------------------------------------------------------- earlier checks on CUDA
section sdpa-shapes checks.log 90 python benchmarks/gpu_checks.py sdpa-shapes
section head-parity checks.log 90 python benchmarks/gpu_checks.py head-parity

# ---------------------------------------------------------------- FSDP2, bf16, CUDA
cat >"$WORK/fsdp2_step.py" <<'PY'
"""Two FSDP2 steps (bf16 MixedPrecisionPolicy) of SFT on CUDA; prints what ran where.
OFFLOAD=1: fsdp_cpu_offload (shards and optimizer state in CPU memory)."""
import logging, math, os, random, tempfile
import torch
from grimoire import GrimoireTrainer, TrainerCallback, TrainingConfig
from grimoire.losses import SFTLoss
from grimoire.model.tiny import build_model, build_tokenizer

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
section fsdp2-1proc fsdp2_step.log 90 python "$WORK/fsdp2_step.py"
section fsdp2-torchrun fsdp2_step.log 90 \
  torchrun --nproc-per-node 1 --master-port 29533 "$WORK/fsdp2_step.py"
section fsdp2-cpu-offload fsdp2_step.log 90 env OFFLOAD=1 python "$WORK/fsdp2_step.py"

# ---------------------------------------------------------------- Liger, precision
section liger checks.log 120 python benchmarks/gpu_checks.py liger
section precision-auto checks.log 45 python benchmarks/gpu_checks.py precision

# ---------------------------------------------------------------- fused log-probs on CUDA
section fused-logprobs fused_logprobs.log 120 python benchmarks/fused_logprobs.py --device cuda \
  --vocabs 32000,128000,256000 --batch 4 --seq-len 2048 --hidden 2048 --layers 2 --repeats 5

cat "$OUT/summary.txt"
