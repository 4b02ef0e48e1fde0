"""Given infrastructure for the course: launching ranks, choosing the implementation under test,
generating skeletons, and the grading report. Nothing in here is a TODO."""
