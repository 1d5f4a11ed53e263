"""The Kimi vision path: MoonViT encoder, patch merger + projector, image preprocessing."""
