"""The training room: offline tools that make new weights for the runtime to serve (Medusa heads,
distilled students). They may import the runtime (they run the model to make their data); the
runtime never imports them (tests/test_rooms.py)."""
