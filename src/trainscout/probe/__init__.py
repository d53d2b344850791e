"""The probe runs inside every rank process; `trainscout run` injects it through a sitecustomize bootstrap."""
