"""The expert formats: MXFP4 (the upstream's) and TWX (moeshrink's), and reading upstream expert weights in any of them."""
