"""Rollouts that decide themselves: the controller that moves each canary's steps."""
