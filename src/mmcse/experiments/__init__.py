"""What runs many trainings: ablations, sweeps, upstream artifacts, plans, reports, profiles."""
