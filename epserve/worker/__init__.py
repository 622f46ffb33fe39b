"""The model side of a step, one path for any ep_size: ``StepModel`` (the Model traits) turns a
forward into one step command; each rank's ``RankExecutor`` validates and applies it and its
``Runner`` runs the forward (graphs, lookahead) and samples; the KV book, the EP channel and
comm."""
