"""The course's modules, one file per concept, in two packages: solutions/ holds the reference
implementations, and steps/ the learner's skeletons generated from them (`python -m course.skeleton`),
in which every solution block is a TODO to fill in."""
