"""`python -m intervene`: push the residual stream along a saved probe's direction and read what the model says
(intervene.run); the hooks and readouts (intervene.steer)."""
