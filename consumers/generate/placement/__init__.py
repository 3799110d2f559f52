"""Where a generate worker's prompts run: on this worker's server now, held back, given
back to the queue for a peer to start sooner, or moved mid-answer to a faster server.

- flow_control.py: how many chunks the worker holds (enough to fill its slots, no prompt
  more than it can start soon);
- held_prompts.py: one delivery's prompts, started as slots free, the rest given back
  when a peer could start them sooner; its running answers handed over (a slower
  server's last answers, a drain, a pause);
- resume.py: what may move mid-answer, and continuing it on another server;
- peers.py / idle_beat.py: the other workers' idle slots, read from their heartbeats,
  and this worker's, announced within a second;
- stand_down.py with answer_stats.py: leaving a job's last prompts to faster servers,
  from how fast this server decodes.

The writes these decide go through the chunk's lease (chunk_life/: `give_back_unstarted`,
the hand-off). docs/design/placement.md, "Only what can start soon", "Faster servers take the
end" and "A slow server's last answers move".
"""
