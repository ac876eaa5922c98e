"""mapmatched_torch (package assembled in __init__ at the end of the foundation work)."""
