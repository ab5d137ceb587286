"""The rollout controller actor: canary analysis from completion records (control/policy/rollout.py)."""
