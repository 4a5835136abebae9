"""Drafter training: chat data (data), cached target features (features, extract), the run's settings and
drafter (config), the training-time-test objective (ttt), the loop with checkpoints and eval (loop), and the
static draft vocabularies (vocab_lists). The command lines are in spechead.cli.train and spechead.cli.vocab."""
