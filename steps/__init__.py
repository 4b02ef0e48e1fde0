"""Reference implementations of every module. steps/ is generated from these files."""
