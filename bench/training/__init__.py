"""Training benchmarks: draft-training steps and trained drafts against their base."""
