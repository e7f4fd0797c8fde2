"""Teachers: frozen encoders (ResNet-50, CLIP, open_clip, text teachers) and their cached features."""
