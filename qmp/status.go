package qmp

import "context"

// StatusInfo is QEMU's run state as reported by query-status.
type StatusInfo struct {
	Status  string `json:"status"` // e.g. "running", "paused", "prelaunch", "postmigrate"
	Running bool   `json:"running"`
}

// Status runs query-status.
func (c *Client) Status(ctx context.Context) (StatusInfo, error) {
	var st StatusInfo
	err := c.Execute(ctx, "query-status", nil, &st)
	return st, err
}
