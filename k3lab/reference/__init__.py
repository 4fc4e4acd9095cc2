"""The unfused PyTorch truth of every boundary, written op by op the way the model is."""
