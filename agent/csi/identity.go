package csi

import (
	"context"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// DriverName is the CSI driver's name: the CSIDriver object's, the volume's
// `csi.driver` and the kubelet's plugin directory's.
const DriverName = "ram.vmsnap.dev"

// identity answers the CSI Identity service: who the plugin is and that it
// is ready. A node-only plugin has no controller capabilities to announce.
type identity struct {
	csipb.UnimplementedIdentityServer
	version string
	ready   func() bool
}

func (id *identity) GetPluginInfo(context.Context, *csipb.GetPluginInfoRequest) (*csipb.GetPluginInfoResponse, error) {
	return &csipb.GetPluginInfoResponse{Name: DriverName, VendorVersion: id.version}, nil
}

func (id *identity) GetPluginCapabilities(context.Context, *csipb.GetPluginCapabilitiesRequest) (*csipb.GetPluginCapabilitiesResponse, error) {
	return &csipb.GetPluginCapabilitiesResponse{}, nil
}

func (id *identity) Probe(context.Context, *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	return &csipb.ProbeResponse{Ready: wrapperspb.Bool(id.ready == nil || id.ready())}, nil
}
