"""The job templates (train.sh, train-torchrun.sh) and the body they share (job-body.sh)."""
