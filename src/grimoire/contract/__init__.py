"""The contract between the stages: what a batch's layout is (``layout.py``) and what a training
method is. It sits below every stage of the step, so the loader, the budget, the forward pass,
the rollout and the loop all read the same definitions instead of describing them again."""
