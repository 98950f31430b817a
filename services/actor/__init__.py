"""The actor role: rollout engine, policy trainer and frozen reference policy in one process."""
