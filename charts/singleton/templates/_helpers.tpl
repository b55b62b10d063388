{{/*
Names. "singleton.fullname" is the release's base name (the release name when it already
contains the chart name, else "<release>-singleton"); the operator's objects are
"<fullname>-operator" (so a release named "singleton" gives "singleton-operator").
Cluster-scoped objects (ClusterRole, ClusterRoleBinding, admission policy) carry the
release's name, so two releases never collide.
*/}}
{{- define "singleton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "singleton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "singleton.operatorName" -}}
{{- printf "%s-operator" (include "singleton.fullname" .) }}
{{- end }}

{{- define "singleton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "singleton.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator's own leader-election Lease (in the release namespace). The operator uses
this fixed name; it is here so the Role and the NOTES agree with it.
*/}}
{{- define "singleton.leaseName" -}}
singleton-operator
{{- end }}

{{- define "singleton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "singleton.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "singleton.sidecarImage" -}}
{{- default (include "singleton.image" .) .Values.sidecarImage }}
{{- end }}

{{/* Labels that select the operator's pods; never change them (Deployment selectors are immutable). */}}
{{- define "singleton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "singleton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Standard labels for every object. Pass a dict: (dict "ctx" $ "component" "operator").
*/}}
{{- define "singleton.labels" -}}
{{- $ctx := .ctx -}}
helm.sh/chart: {{ include "singleton.chart" $ctx }}
app.kubernetes.io/name: {{ include "singleton.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: singleton
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
{{- with $ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The admission policy's API version: v1, GA since Kubernetes 1.30; the chart's kubeVersion
is >= 1.34.
*/}}
{{- define "singleton.admissionPolicyAPIVersion" -}}
{{- print "admissionregistration.k8s.io/v1" }}
{{- end }}

{{/* Whether the ServiceMonitor is rendered; fails with a clear message when it cannot be. */}}
{{- define "singleton.serviceMonitorEnabled" -}}
{{- if .Values.serviceMonitor.enabled }}
{{- if not .Values.metrics.service.enabled }}
{{- fail "serviceMonitor.enabled=true needs metrics.service.enabled=true (the ServiceMonitor scrapes that Service)" }}
{{- end }}
{{- if or .Values.serviceMonitor.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") }}
{{- print "true" }}
{{- else }}
{{- fail "serviceMonitor.enabled=true but the cluster serves no monitoring.coreos.com/v1 ServiceMonitor (install the Prometheus Operator's CRDs first; with `helm template`, pass --api-versions monitoring.coreos.com/v1/ServiceMonitor; or set serviceMonitor.force=true)" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"true" when a monitoring.coreos.com/v1 object of "kind" is to be rendered: "values" (its
values: enabled, force) enabled, and the API served or forced; enabled without either fails
with a message naming "key" (the values' path).
*/}}
{{- define "singleton.monitoringApi" -}}
{{- if .values.enabled }}
{{- if or .values.force (.ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind)) }}
{{- print "true" }}
{{- else }}
{{- fail (printf "%s.enabled=true but the cluster serves no monitoring.coreos.com/v1 %s (install the Prometheus Operator's CRDs first; with `helm template`, pass --api-versions monitoring.coreos.com/v1/%s; or set %s.force=true)" .key .kind .kind .key) }}
{{- end }}
{{- end }}
{{- end }}
