"""Engine and Scheduler: sampling params, outputs, detokenizer, stop checks (no torch.cuda)."""
