package csi

import (
	"context"
	"log/slog"

	registerpb "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// registration answers the kubelet's plugin watcher, which finds the socket
// in its plugins_registry directory, asks what the plugin is and where its
// CSI socket is, and reports whether it took it.
type registration struct {
	registerpb.UnimplementedRegistrationServer
	endpoint string // the CSI socket, as the kubelet sees it
	log      *slog.Logger
	// failed learns of a refused registration: the plugin is useless then,
	// and the agent's restart makes the kubelet try again.
	failed func(reason string)
}

func (r *registration) GetInfo(context.Context, *registerpb.InfoRequest) (*registerpb.PluginInfo, error) {
	return &registerpb.PluginInfo{
		Type:              registerpb.CSIPlugin,
		Name:              DriverName,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registration) NotifyRegistrationStatus(_ context.Context, st *registerpb.RegistrationStatus) (*registerpb.RegistrationStatusResponse, error) {
	if st.GetPluginRegistered() {
		r.log.Info("csi: the kubelet registered the node plugin", "driver", DriverName, "endpoint", r.endpoint)
		return &registerpb.RegistrationStatusResponse{}, nil
	}
	reason := clip(st.GetError(), 512)
	r.log.Error("csi: the kubelet refused the node plugin", "driver", DriverName, "error", reason)
	if r.failed != nil {
		r.failed(reason)
	}
	return &registerpb.RegistrationStatusResponse{}, nil
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}
