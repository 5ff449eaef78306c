"""Tasks app runs (registry.py: TASKS by name), the run record (record.py) and what they share. Nothing is
imported here: a sweep's job process loads the record callback without torch."""
