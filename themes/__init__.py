"""Colour roles shared by the app, the terminal reports and the SVG charts: `palette.py` (no
dependency, so the benches import it without the chat app's packages) and the Textual themes
built on them (`textual_themes.py`)."""
