"""PLACEHOLDER — to be written (cross_entropy_loss_grad, reference)."""
