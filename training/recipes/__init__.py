"""Recipes: training algorithms written over a session (training.session.contract.Session): GRPO
(grpo: the math, signal: which groups it learns from, grpo_update: one update and grpo_train_step
over a policy, minibatches), SFT and DPO (supervised), ART's update (art, art_loss, art_config) and
learning-rate schedules (schedules)."""
