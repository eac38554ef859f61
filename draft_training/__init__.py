"""Training drafts for a target: distillation from the target's own outputs.

`python -m draft_training` (`draft-training`) runs the steps:

- `split`: the fixed train / held-out split of the benchmark prompts (`draft_training/data/split.json`,
  committed; figures of trained drafts are measured on held-out prompts only);
- `collect`: the teacher (the exact fp32 target the verifier runs) continues the train prompts,
  greedy and sampled at T 1, several sequences per forward, and stores each position's token with
  the teacher's top-32 probabilities and the rest of the mass (resumable).

The split and the records are plain JSON and numpy `.npz` files read with `allow_pickle=False`.
"""
