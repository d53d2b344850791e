"""The job `trainscout demo` watches: a tiny GPT trained with DDP on CPU ranks (gloo), small enough for a laptop.

It is an ordinary torchrun script with no trainscout imports, on purpose: the demo must show trainscout
attaching to an unmodified script, with faults injected from the environment.
"""
