"""Draw docs/img/step.svg (one step's data path and the layers): python docs/img/draw_step.py."""
from html import escape
W, H = 1260, 852
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans, Arial, sans-serif">',
       '<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker></defs>',
       f'<rect width="{W}" height="{H}" fill="#ffffff"/>',
       '<text x="20" y="34" font-size="20" font-weight="bold" fill="#222">One optimizer step: the data path through the stage folders</text>']
stages = [
    ("rows/", "rows → token columns", ["sources", "sft · preference", "kto · prompts", "pretokenized"]),
    ("batching/", "which rows, and when", ["budget (token cost)", "steps (planner)", "bin_packing (LPT)", "loader"]),
    ("collate/", "rows → tensors", ["padded or packed", "packing: [1, L] rows", "per-format collators", "layout: contract/"]),
    ("rollout/", "online methods only", ["engines/ (sample)", "agents/ (episodes)", "rewards/ (score)", "assembly · stage", "batches"]),
    ("forward/", "model → log-probs", ["logprobs", "batch (by layout)", "completions", "fused_head + head/", "reference", "precomputed"]),
    ("losses/", "log-probs → loss", ["functional (math)", "one class a method", "base (GrimoireLoss)"]),
    ("normalise/", "loss units over ranks", ["reduction: one", "all-reduce a step", "loss units"]),
    ("optim/", "update the weights", ["optimizers", "clip · rescale"]),
]
bw, bh, gap, x0, y0 = 142, 166, 13, 20, 60
for i, (name, what, mods) in enumerate(stages):
    x = x0 + i * (bw + gap)
    fill = "#fff4e0" if name == "rollout/" else "#e8f0fb"
    out.append(f'<rect x="{x}" y="{y0}" width="{bw}" height="{bh}" rx="8" fill="{fill}" stroke="#35608f" stroke-width="1.5"/>')
    out.append(f'<text x="{x+bw/2}" y="{y0+24}" font-size="15" font-weight="bold" text-anchor="middle" fill="#1d3c5e">{escape(name)}</text>')
    out.append(f'<text x="{x+bw/2}" y="{y0+42}" font-size="10" text-anchor="middle" fill="#555" font-style="italic">{escape(what)}</text>')
    for j, m in enumerate(mods):
        out.append(f'<text x="{x+10}" y="{y0+66+j*19}" font-size="11" fill="#222">{escape(m)}</text>')
    if i:
        out.append(f'<line x1="{x-gap+1}" y1="{y0+bh/2}" x2="{x-2}" y2="{y0+bh/2}" stroke="#444" stroke-width="2" marker-end="url(#a)"/>')
out.append(f'<text x="{x0}" y="{y0+bh+24}" font-size="12" fill="#444">The loop (training/trainer.py) wires these together and never asks which method it runs; a method plugs in through contract/method.py (the Method protocol, which GrimoireLoss implements).</text>')
# Layers
ly = 306
out.append(f'<text x="20" y="{ly}" font-size="20" font-weight="bold" fill="#222">Layers: imports only run down (enforced by lint-imports and tests/test_architecture.py)</text>')
layers = [
    ("train.py · __main__.py  (entry points: python -m grimoire.train / grimoire)", "#f3e8fb"),
    ("cli/ · tools/ · data/ · registry.py  (what users call)", "#f3e8fb"),
    ("compat/  grimoire-rl's, TRL's and mini_trainer's names (the core never imports it)", "#f3e8fb"),
    ("training/  loop, set-up steps, callbacks, checkpoints, report", "#e8f0fb"),
    ("optim/ · normalise/", "#e8f0fb"),
    ("parallel/  FSDP2, DCP, signals, launcher (torch's own engine)", "#eef7ee"),
    ("model/  precision, checkpointing, packed attention, compile, Liger, NEFTune, OSFT", "#eef7ee"),
    ("losses/", "#e8f0fb"),
    ("rollout/", "#fff4e0"),
    ("forward/", "#e8f0fb"),
    ("collate/", "#e8f0fb"),
    ("batching/", "#e8f0fb"),
    ("rows/", "#e8f0fb"),
    ("contract/  a batch's layout, the method contract", "#f4f4f4"),
    ("config/  TrainingConfig, every short name, TrainingContext, a model's shape", "#f4f4f4"),
    ("columns.py · errors.py  (leaves)", "#f4f4f4"),
]
lh, lw = 29, 640
for i, (text, fill) in enumerate(layers):
    y = ly + 14 + i * (lh + 2)
    out.append(f'<rect x="20" y="{y}" width="{lw}" height="{lh}" rx="5" fill="{fill}" stroke="#8aa" stroke-width="1"/>')
    out.append(f'<text x="32" y="{y+19}" font-size="12.5" fill="#222">{escape(text)}</text>')
top, bottom = ly + 20, ly + 14 + len(layers) * (lh + 2) - 8
out.append(f'<line x1="{lw+45}" y1="{top}" x2="{lw+45}" y2="{bottom}" stroke="#444" stroke-width="2.5" marker-end="url(#a)"/>')
out.append(f'<text x="{lw+60}" y="{(top+bottom)/2-30}" font-size="13" fill="#222">imports point down only:</text>')
notes = ["a later stage may use an earlier one,", "never the reverse. rollout sits above", "forward because it scores its samples", "with the same log-prob forward.", "", "Siblings on one line (cli | tools | data | registry,", "optim | normalise, columns | errors)", "do not import each other.", "", "No cycle, no function-level import of", "a grimoire module, no file over 450 lines,", "no function over 60."]
for k, n in enumerate(notes):
    out.append(f'<text x="{lw+60}" y="{(top+bottom)/2-10+k*18}" font-size="12" fill="#444">{escape(n)}</text>')
out.append("</svg>")
open(__import__("pathlib").Path(__file__).with_name("step.svg"), "w").write("\n".join(out) + "\n")
