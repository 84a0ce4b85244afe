"""The draft service: proposes tokens with a small model or the model-free n-gram drafter."""
