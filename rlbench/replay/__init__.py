"""Features built on the loop and the run directory: replay, diff, resume, slime import."""
