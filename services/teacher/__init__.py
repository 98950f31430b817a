"""The teacher role: a frozen model grading the student's samples token by token (on-policy distillation)."""
