"""A small demo model's foundation: procedural shapes with prompts (`shapes`), and the metrics
that judge reconstructions and generations against them (`metrics`)."""
