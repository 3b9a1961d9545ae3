"""CR schema in Python: constants, spec parsing and status rendering. Pure, stdlib only."""
