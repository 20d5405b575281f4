"""Finetuning a pretrained BERT on Megatron's downstream tasks (RACE, MNLI, QQP), as Megatron's tasks/.

`records` and the per-task readers (`glue`, `race`, `hf`) turn files into records, `samples` builds the
model's inputs, `model` is the classifier on the BERT pooler, `finetune` the training and accuracy loop that
`megatron_train.tasks.main --task RACE|MNLI|QQP` runs (docs/architecture.md, downstream tasks).
"""
