"""The rollout controller actor: canary analysis from completion records (actors/rollout/policy.py)."""
