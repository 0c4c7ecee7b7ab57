"""Checks of the files a user hands dtlaunch, one module per kind, each run before any worker starts.

Every checker reads as little as it needs (a safetensors header, never the weights; a JSON file; a
template rendered once) and raises an InputError naming the file (and line, where there is one) and
the fix, so a spoiled input ends in exit 2 with one line instead of a library's exception.
"""
