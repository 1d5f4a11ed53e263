"""`kdaserve plan`: a deployment's fit, speed and cost on paper (docs/deployment.md)."""
