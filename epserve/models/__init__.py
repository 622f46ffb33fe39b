"""Model interface (traits), configs, one file per architecture, and the checkpoint loader."""
