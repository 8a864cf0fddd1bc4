"""FX graph passes of the compiletune compile pipeline, one per file."""
