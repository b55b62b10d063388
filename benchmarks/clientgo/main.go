// clientgo-elector: the reference peer for benchmarks/compare_clientgo.py. It campaigns
// for one Lease with client-go's leaderelection (LeaseLock, ReleaseOnCancel) and serves
// the same /readyz and /leader shape as the singleton sidecar where they overlap.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
)

// state is what /leader and /readyz report: leading from OnStartedLeading to
// OnStoppedLeading, the lifetime of the context client-go hands the app's work.
type state struct {
	mu      sync.Mutex
	leading bool
	since   *time.Time
}

func (s *state) set(leading bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.leading = leading
	if leading {
		now := time.Now().UTC()
		s.since = &now
	} else {
		s.since = nil
	}
}

func (s *state) get() (bool, *time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leading, s.since
}

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig file (default: in-cluster)")
	namespace := flag.String("namespace", "default", "namespace of the Lease")
	name := flag.String("name", "", "name of the Lease (required)")
	identity := flag.String("identity", "", "candidate identity (default: host name and PID)")
	listen := flag.String("listen", "127.0.0.1:8080", "host:port for /readyz and /leader")
	leaseDuration := flag.Duration("lease-duration", 15*time.Second, "LeaseDuration")
	renewDeadline := flag.Duration("renew-deadline", 10*time.Second, "RenewDeadline")
	retryPeriod := flag.Duration("retry-period", 2*time.Second, "RetryPeriod")
	klog.InitFlags(nil)
	flag.Parse()
	if *name == "" {
		fmt.Fprintln(os.Stderr, "clientgo-elector: error: --name is required")
		os.Exit(2)
	}
	if *identity == "" {
		host, _ := os.Hostname()
		*identity = fmt.Sprintf("%s_%d", host, os.Getpid())
	}

	var config *rest.Config
	var err error
	if *kubeconfig != "" {
		config, err = clientcmd.BuildConfigFromFlags("", *kubeconfig)
	} else {
		config, err = rest.InClusterConfig()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "clientgo-elector: error: %v\n", err)
		os.Exit(2)
	}
	config.UserAgent = "clientgo-elector"
	client := kubernetes.NewForConfigOrDie(config)

	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: *namespace, Name: *name},
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: *identity},
	}
	st := &state{}
	var elector *leaderelection.LeaderElector
	elector, err = leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		ReleaseOnCancel: true,
		LeaseDuration:   *leaseDuration,
		RenewDeadline:   *renewDeadline,
		RetryPeriod:     *retryPeriod,
		Name:            *name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(context.Context) {
				st.set(true)
				klog.Infof("started leading as %s", *identity)
			},
			OnStoppedLeading: func() {
				st.set(false)
				klog.Infof("stopped leading")
			},
			OnNewLeader: func(leader string) { klog.Infof("new leader: %s", leader) },
		},
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "clientgo-elector: error: %v\n", err)
		os.Exit(2)
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if leading, _ := st.get(); leading {
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("leader\n"))
			return
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte("not leader\n"))
	})
	mux.HandleFunc("GET /leader", func(w http.ResponseWriter, _ *http.Request) {
		leading, since := st.get()
		// "ready" and "token" as the sidecar names them; client-go has no fencing token, so
		// the token is the term's start in epoch ms: it tells terms apart, nothing checks it.
		doc := map[string]any{"identity": *identity, "isLeader": leading, "ready": leading, "leader": nil,
			"since": nil, "token": nil}
		if leader := elector.GetLeader(); leader != "" {
			doc["leader"] = leader
		}
		if since != nil {
			doc["since"] = since.Format("2006-01-02T15:04:05.000Z")
			doc["token"] = since.UnixMilli()
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(doc)
	})
	listener, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "clientgo-elector: error: --listen: %v\n", err)
		os.Exit(2)
	}
	go func() { _ = http.Serve(listener, mux) }()

	ctx, cancel := context.WithCancel(context.Background())
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-signals
		klog.Infof("%v: releasing the lock", sig)
		cancel()
	}()
	// Run returns after OnStoppedLeading: on cancel (the lock released first, as
	// ReleaseOnCancel asks) or when leadership is lost. Either way this process is done.
	elector.Run(ctx)
	if ctx.Err() == nil {
		klog.Errorf("leadership lost")
		os.Exit(1)
	}
	os.Exit(0)
}
